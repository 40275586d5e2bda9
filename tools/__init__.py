"""Tools that inspect or measure the code, outside the course and the lab:

    python -m tools.bench          seconds per step, its split, and memory, against TRL (bench.py)
    python -m tools.decode_floor   generate's time against its floor on one model (decode_floor.py)
    python -m tools.trace_step     the files and calls one training step goes through (trace_step.py)
    python -m tools.same_metrics   two runs' metrics.jsonl equal to a relative tolerance (same_metrics.py)
    python -m tools.power          the committed comparisons' p, and the seeds an effect needs (power.py)
    python -m tools.checkpoints    every checkpoint of some runs against their warm start (checkpoints.py)
    python -m tools.loops          the held-out episodes of tool runs that loop on a phrase (loops.py)

Nothing in the lessons, train.py or the lab imports them.
"""
