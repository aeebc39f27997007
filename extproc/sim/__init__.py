"""The fleet simulator: the gateway's own placement and admission code on a simulated fleet.

Layers, each importable alone: ``traffic`` (trace -> many sessions), ``model`` (clusters),
``vector`` (the core's rendezvous hash for a million sessions with numpy), ``policies``,
``events``, ``engine`` (the event loop), ``report`` (figures), ``scenario`` (options -> run),
``cmd`` (the ``extproc simulate`` verb).
"""
