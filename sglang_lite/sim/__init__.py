"""A PD cluster simulator in virtual time that routes with the router's own policy objects."""
