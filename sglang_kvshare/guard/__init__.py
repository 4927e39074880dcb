"""The fidelity guard: how much reuse changes a scope's outputs, measured while serving, and kept on target.

``measure`` compares a served request's next-token distributions with a dense
reference's; ``estimate`` keeps a running value with a 95 % interval per
scope; ``target`` parses ``--kvshare-fidelity-target``; ``controller`` turns
estimates into settings (a longer recomputed head, then dense) and back.
These modules hold the math only: no SGLang, no I/O.
"""
