"""The side channel between ranks: every rank's last collectives and heartbeat in the rendezvous
store (``sidechannel``), read as untrusted data (``peer``), gathered into a diagnosis
(``gather``), with store reads that give up when the store is out of reach (``reach``).
"""
