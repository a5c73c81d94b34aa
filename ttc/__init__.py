"""Test-time compute: Markovian RSA (:mod:`ttc.rsa`) over the torch engine, vLLM or any
OpenAI-compatible server (:mod:`ttc.backends`), its prompt templates (:mod:`ttc.templates`), an
OpenAI-compatible server over a checkpoint (:mod:`train.engine.server`, re-exported as :mod:`ttc.serve`) and
the ``ttc`` command (:mod:`ttc.cli`)."""
