"""Request queues, the batching policy, routing requests to runtimes, and pricing what ran.

    policy.py           the pure batching core: no clocks, no I/O, fed times by its caller
    pricing.py          the pure pricing core (a request's share of its batch's time, priced into
                        cloud/usage.py's Usage) and UsageSink, where the engines send usage (the
                        ledger, cloud/metering.py)
    observer.py         what the engines report for metrics (the Prometheus one is cloud/metrics.py)
    engine.py           the engine the API talks to, and the in-process one that drives the policy
    streams.py          the distributed engine: Redis Streams, placement on runtime processes,
                        the pool streams requests wait in while their device type has no runtime,
                        the ledger consumer
    autoscale.py        the pure autoscaling rule (KEDA's): runtimes per pool from its backlog,
                        scale-in of idle ones to zero; api/stack.py applies it
    wire.py             what gateways and runtime processes (runtime/process.py) say to each other
"""
