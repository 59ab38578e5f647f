"""Everything that speaks to OpenRouter, over one HTTP stack (aiohttp):

    client.py     one chat completion: the request body, the POST, every outcome sorted into what to do
                  next; when a request that makes no progress behind keep-alive is given up, and the
                  count of requests waiting on padding alone
    retry.py      backoff with jitter, and the AIMD limit on requests in flight
    pricing.py    the endpoint list (`fetch_endpoints`), the worst price of a request, the quantization
                  families, the bill of a lost answer, the balance left (`BalanceReader`), the
                  endpoint table and the precision policy (the `provider` routing object)
    budget.py     the spend and token budgets stage 02 reserves against
    apikey.py     reading the key, which is never printed, logged or saved
    api.py        stage 01's synchronous calls (endpoints, balance, chat) on a short-lived event loop
"""
