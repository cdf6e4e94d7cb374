"""The server: launcher, settings, REAP routes and the API process's swap controller."""
