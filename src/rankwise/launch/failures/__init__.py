"""What the launcher says when a job fails: the failure summary (``report``), the ranks'
diagnoses it quotes (``diagnoses``), lost machines (``machines``) and restarts (``restarts``).
"""
