"""The engine core (scheduler + executor step loop), its process, and the clients of both."""
