# A stdlib logger used on every rank of a DDP job.
import logging

import rankwise as rw

log = logging.getLogger("train")
rt = rw.init()
log.info("starting training on %s", rt.device)  # expect: RW007
