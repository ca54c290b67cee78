"""SpecSplit routers: one per service, routing by rendezvous hash of the session id (or its group).

Imports schemas, zmq and the transport's socket factory only (never torch). Nothing happens at
import time; ``python -m brokers draft|target`` runs a router.
"""
