"""What every pdserve process shares: the msgspec protocol (protocol.py), a worker's link to the
coordinator (link.py), CurveZMQ keys and the loopback rule (security.py), ZeroMQ sockets
served from an asyncio loop (loop_io.py), and the liveness file a role touches for its launcher
(liveness.py). The client-facing messages, sampling parameters and base errors it builds on are
the client distribution's (pdserve_client); of runtime it imports only the torch-free errors and flags;
nothing here imports a serving package."""
