"""jaxptd's benchmarks (not tests): each module prints a table and the command that
reproduces it, and writes its results under bench/results/. Run from the repository root
as `python -m bench.NAME`; a package, so that no module here shadows an installed one
(a `kernels.py` on sys.path hid the `kernels` package that transformers imports)."""
