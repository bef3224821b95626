"""Fleet-wide changes under a disruption budget, coordinated through the API server (docs/fleet.md).

``budget``: the operator's budget (one ConfigMap), validated, and its pure math (slots of a pool, maintenance
windows, label selectors, the fair order of requests). ``leases``: the Lease objects the agents take and
release (the only module here that speaks to the API). ``gate``: ``FleetGate.slot(reason)``, the async
context manager a disruptive action waits in. ``status``: what ``nodeagent fleet status`` shows.
"""
