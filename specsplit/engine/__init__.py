"""The compute layer: session KV caches, draft and target engines, verification and sampling,
on whatever device the model is on (torch, never zmq). Tree math lives in ``specsplit.tree``;
device-specific tuning in ``specsplit.backends``."""
