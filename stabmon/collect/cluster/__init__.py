"""What coordinates ranks under ``torch.distributed``: reducing metrics, rank 0 deciding and every rank
following (joint actions), who saves and writes, per-rank signals, how gradients are sharded, a hang told to every
rank, and joining a job again under ``torchrun --max-restarts``.

See docs/ARCHITECTURE.md ("Ranks").
"""
