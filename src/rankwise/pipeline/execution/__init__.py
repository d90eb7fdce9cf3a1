"""Running a pipeline schedule: one executor for every schedule (``executor``), over point-to-point
sends between processes (``p2p``) or queues between threads of one process (``threads``), what a
training step needs around it (``step``), the backward split for zero-bubble schedules
(``weight_pass``), and GPipe's forward run with one thread per stage (``gpipe``).
"""
