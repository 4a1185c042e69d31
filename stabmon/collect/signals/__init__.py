"""What the monitor reads from the model and the loop: gradient, update, activation, embedding, attention and
logit signals, the values a step observes, and the device buffer they wait in until a flush (one host copy).

Nothing here changes training. See docs/ARCHITECTURE.md ("The live path").
"""
