"""Real inference engines on loopback for the real-engine test tier and its benchmarks.

Tools only (never imported by the serving path). Each engine runs in its own venv under
``.engines/`` (``make engine-deps``), started as a subprocess of that venv's interpreter:
``llamacpp`` (llama.cpp's server through the xllamacpp wheel). ``base`` has what every engine
shares: start N engines, wait until each answers its health check, stop, kill, restart.
"""
