"""Everything that speaks to OpenRouter: the chat client and its retry policy (client, retry), the
endpoint catalogue, prices and quantization families (pricing, endpoints), spend and
token budgets (budget), the key (apikey) and stage 01's plain HTTP calls (api)."""
