"""A seeded chaos harness: a real m27 system, a fault schedule drawn from a seed, and
checks of its own records afterwards (issue 19).

- `schedule`: the pure draw of a fault schedule from a seed;
- `programs`: the step programs and pipelines the harness submits (they write markers);
- `faults`: injecting and healing each kind of fault on a live system;
- `harness`: one schedule against one fresh system, end to end;
- `checks`: pure checks of what the system and the steps recorded.
"""
