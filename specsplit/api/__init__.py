"""The OpenAI-compatible HTTP front door (``specsplit api``): Starlette on uvicorn, a client of the
orchestrators, the target's tokenizer only (no torch). See ``specsplit.api.server``."""
