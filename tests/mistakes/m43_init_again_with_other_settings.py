# https://github.com/ddPn08/rvc-webui/pull/54
# mistake: a helper initialises distributed training again, with other settings than the script's first call
# expect-run: already called with strategy | this call asks for strategy=zero2 ; fix: rw.init() once
import rankwise as rw


def setup():
    return rw.init(strategy="zero2")


rt = rw.init(strategy="ddp")
rt = setup()
