"""What ``rankwise check`` learns of a script before its rules run: ast helpers (``astutil``), the
facts rules read (``facts``), where each node runs (``context``), conditions that select ranks
(``guards``), the script's own modules (``imports``) and parameters that hold a rank
(``ranksource``).
"""
