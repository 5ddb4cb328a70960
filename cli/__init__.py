"""The ``qtts`` command line: every command, above the engine and the service.

``cli.main`` builds the parser and maps errors to one line; each command's work lives in its own
module (``convert``/``make-model`` call ``engine.tools``, ``serve`` starts ``service``).
"""
