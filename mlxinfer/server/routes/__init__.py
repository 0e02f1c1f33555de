"""The server's routes, one module per API: each has `routes(api)` over the shared core (core.API), and
app.py puts them together; none imports another, nor app.py."""
