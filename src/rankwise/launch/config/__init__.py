"""``rankwise run``'s settings from a file (``settings``: ``rankwise.toml`` or ``[tool.rankwise]``)
and the ``rankwise config`` command that writes or shows them (``cli``).
"""
