"""Past this machine: the all-reduce measured (``commbench``), an alpha-beta projection of ring
all-reduce to more ranks (``projection``) and across nodes over a given link
(``across_nodes``).
"""
