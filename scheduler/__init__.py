"""Request queues, the batching policy, and routing requests to runtimes.

    policy.py    the pure batching core: no clocks, no I/O, fed times by its caller
    batcher.py   the asyncio adapter that drives one policy queue per model version
    engine.py    the engine the API talks to: routes requests, meters batches
"""
