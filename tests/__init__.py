"""The test suite. A package so that ``tests.support`` (the helpers the tests share) always resolves to this
checkout's, whatever else is installed under the name ``tests``."""
