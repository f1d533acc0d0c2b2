"""The training job's components: checkpoints, evaluation, the seed log, the memory plan,
reporting and preemption."""
