"""A seeded serving benchmark of the bundled runtime (``quantkit bench``): a fixed workload (:mod:`.workload`), an
engine driver with per-request timings and a per-stage profile (:mod:`.run`), an HF ``generate`` baseline
(:mod:`.hf_baseline`) and the report (:mod:`.report`)."""
