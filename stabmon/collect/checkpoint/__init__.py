"""What a checkpoint holds and how the run comes back from one: the training state by name and what each reason
to load leaves alone, the monitor's own state in it, a resumed run's step count, and the recovery verbs
(rollback, checkpoint-and-stop) that interventions reach through their handle.

See docs/ARCHITECTURE.md ("Checkpoints and recovery").
"""
