"""The job and where this process sits in it: the launcher's environment (``env``: the only
reader of ``os.environ``), the network interface that reaches the master (``netif``), device
names (``devices``), what ``rw.init`` was asked for, settled before joining (``plan``: the
strategy, 'auto' resolved through the registry, and the precision policy), the process group
(``process_group``) and the device mesh (``mesh``).
"""
