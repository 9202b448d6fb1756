"""What several test modules share: the tiny model built in code, short real runs, the browser,
fake servers, kill moments. Test modules import from here, never from each other."""
