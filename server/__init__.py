"""The HTTP front end: the FastAPI app (``app``), the ``flashtier`` command (``cli``) and the routes outside
the three APIs (``routes_misc``: models, health, tokenize, metrics; ``routes_admin``: tenant deletion). Everything
below is in the subpackages.
"""
