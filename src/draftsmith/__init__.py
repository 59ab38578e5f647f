"""draftsmith: prompt datasets -> target responses via OpenRouter -> a trained EAGLE-3 drafter."""
