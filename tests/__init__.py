"""fq's tests: a package, so that the test kits are ``tests.kits`` (see tests/kits/__init__.py) wherever the
checkout is on sys.path: pytest puts it there (the rootdir above this package), and so do the benchmarks."""
