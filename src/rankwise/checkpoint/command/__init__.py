"""``rankwise checkpoint inspect|consolidate``: the command line (``cli``), what a sharded
checkpoint holds (``inspection``), one file streamed from it (``consolidate``) written one tensor
at a time (``torch_zip``).
"""
