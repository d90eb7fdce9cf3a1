"""The wire: every collective rankwise issues outside the engines' hot paths, fingerprinted
(``collectives``: ``rw.all_reduce_mean`` and the library's own), bytes and JSON between ranks
without pickle (``wire``), and parameters or gradients as one flat buffer (``flat``).
"""
