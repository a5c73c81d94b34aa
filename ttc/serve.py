"""The OpenAI-compatible server now lives in the engine layer (:mod:`train.engine.server`), so RL
rollouts use it without ``train`` importing ``ttc``; this module keeps ``ttc.serve`` imports and
``python -m ttc.serve`` working."""
from train.engine.server import (Batcher, BadRequest, Handler, Server, main, make_server,  # noqa: F401
                                 serve_in_thread)

if __name__ == "__main__":
    import sys

    sys.exit(main())
