# test/python/rabbitmq.sh: a throwaway RabbitMQ broker (Debian's
# rabbitmq-server) on loopback ports, for the Python suite.  Source it;
#   idem_rabbitmq_start DIR   start one in DIR (its AMQP port in DIR/amqp_port)
#   idem_rabbitmq_stop DIR    stop it, and its own epmd
# Its Erlang port mapper runs on a private port, so that neither another
# broker nor another run's shares it.
idem_rabbitmq_start() {
	local dir=$1 amqp dist epmd
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || return 1
	amqp=$(idem_free_port) && dist=$(idem_free_port) && epmd=$(idem_free_port) || return 1
	mkdir -p "$dir/home" "$dir/mnesia" "$dir/log"
	echo '[].' >"$dir/enabled_plugins"
	echo "listeners.tcp.default = 127.0.0.1:$amqp" >"$dir/rabbitmq.conf"
	echo "$epmd" >"$dir/epmd_port"
	(
		export HOME=$dir/home RABBITMQ_NODENAME=idem$amqp@localhost \
			RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$amqp \
			RABBITMQ_DIST_PORT=$dist ERL_EPMD_PORT=$epmd ERL_EPMD_ADDRESS=127.0.0.1 \
			RABBITMQ_MNESIA_BASE=$dir/mnesia RABBITMQ_LOG_BASE=$dir/log \
			RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins \
			RABBITMQ_CONFIG_FILE=$dir/rabbitmq RABBITMQ_PID_FILE=$dir/rabbit.pid
		exec /usr/lib/rabbitmq/bin/rabbitmq-server >"$dir/server.log" 2>&1 9>&-
	) &
	echo $! >"$dir/script.pid"
	# not the shell's job: its SIGKILL at the end is not reported ("Killed")
	disown $!
	# Up to three minutes: Erlang's boot took over a minute on a 2-core
	# machine at load 19.
	for _ in $(seq 1 720); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$amqp") 2>/dev/null; then
			echo "$amqp" >"$dir/amqp_port"
			return 0
		fi
		kill -0 "$(cat "$dir/script.pid")" 2>/dev/null || break
		sleep 0.25
	done
	tail -n 20 "$dir/server.log" >&2
	return 1
}

idem_rabbitmq_stop() {
	local dir=$1 pid
	for f in rabbit.pid script.pid; do
		[ -f "$dir/$f" ] || continue
		pid=$(cat "$dir/$f")
		[ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null
	done
	# epmd refuses to stop while the killed node still looks registered
	if [ -f "$dir/epmd_port" ]; then
		for _ in $(seq 1 30); do
			ERL_EPMD_PORT=$(cat "$dir/epmd_port") epmd -kill >/dev/null 2>&1 && break
			sleep 0.1
		done
	fi
	rm -f "$dir/rabbit.pid" "$dir/script.pid" "$dir/epmd_port"
}
