"""The training job: ``Trainer`` (trainer.py) and the parts it is made of: the checks
before anything is built (validation.py), building (build.py), resuming (resume.py),
the run directory's logs and records (run_logs.py, records.py, seed_log.py),
checkpoints, evaluation, the memory plan, reporting and preemption."""
