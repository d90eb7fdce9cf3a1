"""Rendezvous beyond torch's defaults: c10d with its state signed (``signed``) and the handler's
store calls given a limit so a cut-off node does not hang (``guard``), and ``--rdzv-conf``'s keys
checked against the ones torch reads (``conf``).
"""
