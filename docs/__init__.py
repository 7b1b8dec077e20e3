"""The documentation's tooling (run from a checkout; not part of the installed package):
``python -m docs.samples`` regenerates every output sample in README.md and docs/*.md."""
