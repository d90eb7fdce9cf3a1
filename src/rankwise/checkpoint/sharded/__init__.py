"""Sharded checkpoints in torch DCP's format: every rank saves what it holds (``save``), reads the
saved pieces that overlap what it holds at any world size or mesh (``load``, ``read``); the
geometry of pieces (``pieces``, ``optim_pieces``, ``boxes``), who writes what (``assign``), DCP's
metadata (``dcp_meta``) and the files' checksums (``digests``).
"""
