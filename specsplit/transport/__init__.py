"""Transport: the socket factory (``sockets``), the async RPC client (``rpc``) and the worker
loop (``worker_loop``). zmq only, never torch; nothing happens at import time."""
