"""The training loop: applying the precision policy (``precision``: autocast, the agreed loss
scaler) and the loop verbs of ``rt`` (``loop``: ``backward``, ``clip_grad_norm_``,
``accumulate``, ``log``, with their ``LoopState``).
"""
