"""What runs inside ``optimizer.step()``: the optimizer hooks (unscale, norms, clipping, the overrides in force),
the skip guard, and the in-place changes interventions make to the optimizer state and the weights (moment
resets, QK-clip, update clipping). The only part of the monitor that changes the update.

See docs/ARCHITECTURE.md ("The live path").
"""
