"""``kvtier plan``: predict what tiering does for a workload before buying hardware, and check it.

``spec`` (model, engine, tiers), ``workload`` (traces, generated sessions), ``sim`` (the
discrete-event simulator), ``calibrate`` (figures from a ``kvtier bench`` folder and a probe),
``check`` (calibrate on part of a bench run, predict the rest), ``report`` (table, JSON, PNG).
"""
