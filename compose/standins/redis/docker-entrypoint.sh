#!/bin/sh
# What the official image's entrypoint does for the commands compose uses: options alone mean
# redis-server, and redis-server started as root drops to the redis user. The official build also
# compiles protected mode off by default (a container is reached from other containers, never over
# loopback); Debian's binary defaults it on, so it is turned off here, before the caller's options
# (a later --protected-mode yes still wins).
set -e
case "$1" in
  -*|*.conf) set -- redis-server "$@" ;;
esac
if [ "$1" = redis-server ]; then
  shift
  set -- redis-server --protected-mode no "$@"
  if [ "$(id -u)" = 0 ]; then
    find . \! -user redis -exec chown redis '{}' +
    exec setpriv --reuid=redis --regid=redis --clear-groups "$@"
  fi
fi
exec "$@"
