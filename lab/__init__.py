"""The lab: every comparison of the four reports rerun over seeds.

    python -m lab                 the experiments (main.py; one module per report: report000.py ... report003.py)
    python -m lab.compare         settings side by side over seeds, a table and a figure (compare.py)
Nothing here is imported by the lessons; the lab imports them (the benchmark is in tools/).
"""
