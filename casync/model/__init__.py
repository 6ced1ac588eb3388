"""The engine's cost model, beside the engine: what a step costs and which plan is fastest.

``costmodel`` (linear costs, fitted), ``profiler`` (measures them on the job's own group,
cached), ``engine_costs`` (the engine's own overheads), ``timeline`` and ``simulate``
(a step's lanes, predicted), ``planner`` (``CostPlanner``: per tensor, the fastest plan),
``cluster`` and ``models`` (the hosts and the models the simulator is asked about).
Nothing here runs a step; the engine imports the planner, never the other way round.
"""
