/*
 * unit_cluster.c: the Valkey Cluster routing's pure parts (src/common/valkey_*.c),
 * no server needed: CRC16 and slots (with hash tags) against the values
 * Valkey documents and computes, redirect and transient-error classification,
 * the CLUSTER SLOTS and CLUSTER SHARDS parsers (fed real RESP text through
 * hiredis' reader),
 * seed lists, and a router whose nodes are all down.
 */
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "valkey_router.h"
#include "valkey_reply.h"
#include "tap.h"

void		test_cluster(void);

static int
slot_of(const char *key)
{
	return idem_vc_key_slot(key, strlen(key));
}

/* The CRC16 as the cluster specification writes it: bit by bit. */
static uint16_t
crc16_bitwise(const unsigned char *buf, size_t len)
{
	uint16_t	crc = 0;
	size_t		i;
	int			b;

	for (i = 0; i < len; i++)
	{
		crc ^= (uint16_t) (buf[i] << 8);
		for (b = 0; b < 8; b++)
			crc = (crc & 0x8000) ? (uint16_t) ((crc << 1) ^ 0x1021) : (uint16_t) (crc << 1);
	}
	return crc;
}

static void
test_slots(void)
{
	unsigned char buf[200];
	unsigned int seed = 12345;
	int			i,
				differ = 0;

	tap_ok(idem_vc_crc16("123456789", 9) == 0x31C3,
		   "crc16 of \"123456789\" is 0x31C3 (the cluster spec's check value)");
	for (i = 0; i < 2000; i++)
	{
		size_t		len = (size_t) (rand_r(&seed) % sizeof(buf));
		size_t		k;

		for (k = 0; k < len; k++)
			buf[k] = (unsigned char) rand_r(&seed);
		if (idem_vc_crc16((const char *) buf, len) != crc16_bitwise(buf, len))
			differ++;
	}
	tap_ok(differ == 0,
		   "crc16 equals the bit-by-bit definition on 2000 random buffers of 0-199 bytes, every byte value (%d differ)",
		   differ);
	tap_ok(slot_of("foo") == 12182 && slot_of("bar") == 5061 &&
		   slot_of("hello") == 866,
		   "slots of foo, bar, hello as CLUSTER KEYSLOT gives them (%d %d %d)",
		   slot_of("foo"), slot_of("bar"), slot_of("hello"));
	tap_ok(slot_of("{user1000}.following") == slot_of("{user1000}.followers") &&
		   slot_of("{user1000}.following") == slot_of("user1000"),
		   "a hash tag decides the slot");
	tap_ok(slot_of("foo{}{bar}") ==
		   (idem_vc_crc16("foo{}{bar}", 10) & 16383),
		   "an empty hash tag hashes the whole key");
	tap_ok(slot_of("foo{{bar}}zap") == slot_of("{bar"),
		   "the tag runs from the first { to the next }");
	tap_ok(slot_of("foo{bar}{zap}") == slot_of("bar"),
		   "only the first tag counts");
	tap_ok(slot_of("foo{bar") == (idem_vc_crc16("foo{bar", 7) & 16383),
		   "an unclosed tag hashes the whole key");
	tap_ok(idem_vc_key_slot("", 0) == 0, "the empty key is slot 0");
}

static int
classify(const char *text, int *slot, char *host, int *port)
{
	return idem_vc_classify(text, strlen(text), slot, host, 64, port);
}

static void
test_classify(void)
{
	int			slot = -1,
				port = -1;
	char		host[64] = "";

	tap_ok(classify("MOVED 3999 127.0.0.1:6381", &slot, host, &port) == IDEM_VC_MOVED &&
		   slot == 3999 && strcmp(host, "127.0.0.1") == 0 && port == 6381,
		   "MOVED: slot, host and port");
	tap_ok(classify("ASK 16383 node-b.example:7000", &slot, host, &port) == IDEM_VC_ASK &&
		   slot == 16383 && strcmp(host, "node-b.example") == 0 && port == 7000,
		   "ASK: slot, host and port");
	tap_ok(classify("MOVED 1 ::1:7001", &slot, host, &port) == IDEM_VC_MOVED &&
		   strcmp(host, "::1") == 0 && port == 7001,
		   "an IPv6 host: the port follows the last colon");
	tap_ok(classify("MOVED 16384 h:1", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("MOVED x h:1", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("MOVED 5 h", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("MOVED 5 h:99999", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("MOVED", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("MOVEDX 5 h:1", &slot, host, &port) == IDEM_VC_REPLY,
		   "a malformed redirect is an ordinary error reply");
	tap_ok(classify("CLUSTERDOWN The cluster is down", &slot, host, &port) == IDEM_VC_RETRY &&
		   classify("TRYAGAIN Multiple keys request during rehashing of slot", &slot, host, &port) == IDEM_VC_RETRY &&
		   classify("READONLY You can't write against a read only replica.", &slot, host, &port) == IDEM_VC_RETRY &&
		   classify("LOADING Valkey is loading the dataset in memory", &slot, host, &port) == IDEM_VC_RETRY &&
		   classify("MASTERDOWN Link with MASTER is down", &slot, host, &port) == IDEM_VC_RETRY,
		   "CLUSTERDOWN, TRYAGAIN, READONLY, LOADING, MASTERDOWN: retry later");
	tap_ok(classify("ERR unknown command", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("NOSCRIPT No matching script", &slot, host, &port) == IDEM_VC_REPLY &&
		   classify("WRONGTYPE Operation against a key", &slot, host, &port) == IDEM_VC_REPLY,
		   "other errors are replies for the caller");
}

/*
 * The one list of "not now" error codes (valkey_reply.c), each code with its
 * class, as the worker and the router see it: the worker keeps a batch for
 * both "not now" classes, the router retries only the transient one within
 * its deadline.  A code added, dropped or moved here must be a decision.
 */
static void
test_reply_classes(void)
{
	static const struct
	{
		const char *reply;
		idem_vk_error class;
		int			router;		/* what idem_vc_classify says */
	}			cases[] = {
		{"CLUSTERDOWN The cluster is down", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"TRYAGAIN Multiple keys request during rehashing of slot", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"READONLY You can't write against a read only replica.", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"LOADING Valkey is loading the dataset in memory", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"BUSY Valkey is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"OOM command not allowed when used memory > 'maxmemory'.", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"MISCONF Errors writing to the AOF file: No space left on device", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"NOREPLICAS Not enough good replicas to write.", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"NOAUTH Authentication required.", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"MOVED 3999 127.0.0.1:6381", IDEM_VK_ERR_MOVED, IDEM_VC_MOVED},
		{"ASK 3999 127.0.0.1:6381", IDEM_VK_ERR_ASK, IDEM_VC_ASK},
		/* answers about the command: the record is refused */
		{"ERR unknown command 'FOO'", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"WRONGTYPE Operation against a key holding the wrong kind of value", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"NOPERM User idem has no permissions to access the 'x' key", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"NOSCRIPT No matching script.", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"WRONGPASS invalid username-password pair or user is disabled.", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		/* a code is the whole first word, never a prefix of it */
		{"BUSYKEY Target key name already exists.", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"BUSYGROUP Consumer Group name already exists", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"LOADINGX", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"OOMKILL", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		{"loading lower case is not the code", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
		/* a code alone, with no message */
		{"LOADING", IDEM_VK_ERR_TRANSIENT, IDEM_VC_RETRY},
		{"NOREPLICAS", IDEM_VK_ERR_UNAVAILABLE, IDEM_VC_REPLY},
		{"", IDEM_VK_ERR_ANSWER, IDEM_VC_REPLY},
	};
	int			wrong = 0;
	int			keeps = 0;
	size_t		i;

	for (i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
	{
		const char *r = cases[i].reply;
		size_t		len = strlen(r);
		int			slot,
					port;
		char		host[64];
		idem_vk_error c = idem_vk_error_class(r, len);
		int			rc = idem_vc_classify(r, len, &slot, host, sizeof(host), &port);
		int			not_now = idem_vk_error_not_now(r, len);

		if (c != cases[i].class || rc != cases[i].router ||
			not_now != (c == IDEM_VK_ERR_TRANSIENT || c == IDEM_VK_ERR_UNAVAILABLE))
		{
			tap_diag("\"%s\": class %d (want %d), router %d (want %d), not now %d",
					 r, c, cases[i].class, rc, cases[i].router, not_now);
			wrong++;
		}
		/* what the router retries, the worker keeps */
		if (rc == IDEM_VC_RETRY && !not_now)
		{
			tap_diag("\"%s\": the router retries it, the worker would drop it", r);
			wrong++;
		}
		keeps += not_now;
	}
	tap_ok(wrong == 0, "each error code has its class, for the worker and the router alike");
	tap_ok(keeps == 12, "twelve of the replies above say \"not now\" (%d)", keeps);
	tap_ok(idem_vk_error_not_now("LOADING Valkey is loading", 7) &&
		   !idem_vk_error_not_now("LOADINGX", 8) &&
		   idem_vk_error_code_is("ERR x", 5, "ERR") &&
		   !idem_vk_error_code_is("ERRX", 4, "ERR"),
		   "only the reply's len bytes are read, and a code is a whole word");
}

static redisReply *
resp(const char *text)
{
	redisReader *rd = redisReaderCreate();
	void	   *reply = NULL;

	redisReaderFeed(rd, text, strlen(text));
	if (redisReaderGetReply(rd, &reply) != REDIS_OK)
		reply = NULL;
	redisReaderFree(rd);
	return reply;
}

static void
test_parse_slots(void)
{
	idem_vc_map *map = malloc(sizeof(idem_vc_map));
	/* three masters, the second with a replica and an empty host */
	redisReply *r = resp(
		"*3\r\n"
		"*3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7001\r\n$4\r\nid-a\r\n"
		"*4\r\n:5461\r\n:10922\r\n*3\r\n$0\r\n\r\n:7002\r\n$4\r\nid-b\r\n"
		"*3\r\n$9\r\n127.0.0.1\r\n:7005\r\n$4\r\nid-e\r\n"
		"*3\r\n:10923\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:7003\r\n$4\r\nid-c\r\n");
	redisReply *partial = resp(
		"*2\r\n"
		"*3\r\n:0\r\n:99\r\n*2\r\n$1\r\na\r\n:1\r\n"
		"*3\r\n:200\r\n:200\r\n*2\r\n$1\r\na\r\n:1\r\n");
	redisReply *err = resp("-ERR This instance has cluster support disabled\r\n");
	redisReply *bad = resp("*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n$1\r\na\r\n:1\r\n");
	int			n;

	n = idem_vc_parse_slots(r, "10.0.0.9", map);
	tap_ok(n == 16384 && map->nnodes == 3, "CLUSTER SLOTS: every slot, three masters (%d, %d)",
		   n, map->nnodes);
	tap_ok(map->slot_node[0] == 0 && map->slot_node[5460] == 0 &&
		   map->slot_node[5461] == 1 && map->slot_node[16383] == 2 &&
		   map->ports[0] == 7001 && map->ports[1] == 7002 && map->ports[2] == 7003,
		   "each range goes to its master, replicas are not routed to");
	tap_ok(strcmp(map->hosts[1], "10.0.0.9") == 0,
		   "an empty host is the node that was asked");
	n = idem_vc_parse_slots(partial, "x", map);
	tap_ok(n == 101 && map->nnodes == 1 && map->slot_node[150] == -1 &&
		   map->slot_node[200] == 0,
		   "a partial map: uncovered slots have no node (%d)", n);
	tap_ok(idem_vc_parse_slots(err, "x", map) == -1 &&
		   idem_vc_parse_slots(bad, "x", map) == -1 &&
		   idem_vc_parse_slots(NULL, "x", map) == -1,
		   "an error reply or a slot out of range is not a map");
	freeReplyObject(r);
	freeReplyObject(partial);
	freeReplyObject(err);
	freeReplyObject(bad);
	free(map);
}

static int
poll_wait(void *arg, int fd, int for_write, int64_t deadline)
{
	struct pollfd p;
	int64_t		left = deadline - idem_vc_now_ms();

	(void) arg;
	if (left < 0)
		left = 0;
	p.fd = fd;
	p.events = for_write ? POLLOUT : POLLIN;
	p.revents = 0;
	if (poll(fd < 0 ? NULL : &p, fd < 0 ? 0 : 1, (int) left) > 0)
		return 0;
	return fd < 0 ? 0 : -1;
}

/* One CLUSTER SHARDS node entry, as Valkey 8 writes it. */
#define SHARD_NODE(id, port, ip, endpoint, role, health) \
	"*14\r\n$2\r\nid\r\n$4\r\n" id "\r\n$4\r\nport\r\n:" port "\r\n" \
	"$2\r\nip\r\n" ip "$8\r\nendpoint\r\n" endpoint \
	"$4\r\nrole\r\n" role "$18\r\nreplication-offset\r\n:0\r\n" \
	"$6\r\nhealth\r\n" health

static void
test_parse_shards(void)
{
	idem_vc_map *map = malloc(sizeof(idem_vc_map));
	/*
	 * Three shards as Valkey 8.0.1 answered (master then replica), the
	 * first serving two ranges, the second with a "?" endpoint, the third
	 * just failed over: its old master, failed, is listed before the new.
	 */
	redisReply *r = resp(
		"*3\r\n"
		"*4\r\n$5\r\nslots\r\n*4\r\n:0\r\n:5000\r\n:5001\r\n:5460\r\n"
		"$5\r\nnodes\r\n*2\r\n"
		SHARD_NODE("id-a", "7001", "$9\r\n127.0.0.1\r\n", "$9\r\n127.0.0.1\r\n",
				   "$6\r\nmaster\r\n", "$6\r\nonline\r\n")
		SHARD_NODE("id-d", "7004", "$9\r\n127.0.0.1\r\n", "$9\r\n127.0.0.1\r\n",
				   "$7\r\nreplica\r\n", "$7\r\nloading\r\n")
		"*4\r\n$5\r\nslots\r\n*2\r\n:5461\r\n:10922\r\n"
		"$5\r\nnodes\r\n*1\r\n"
		SHARD_NODE("id-b", "7002", "$3\r\n::1\r\n", "$1\r\n?\r\n",
				   "$6\r\nmaster\r\n", "$6\r\nonline\r\n")
		"*4\r\n$5\r\nslots\r\n*2\r\n:10923\r\n:16383\r\n"
		"$5\r\nnodes\r\n*2\r\n"
		SHARD_NODE("id-c", "7003", "$9\r\n127.0.0.1\r\n", "$9\r\n127.0.0.1\r\n",
				   "$6\r\nmaster\r\n", "$4\r\nfail\r\n")
		SHARD_NODE("id-f", "7006", "$9\r\n127.0.0.1\r\n", "$9\r\n127.0.0.1\r\n",
				   "$6\r\nmaster\r\n", "$6\r\nonline\r\n"));
	/* a shard whose only node is a replica, one with no slots */
	redisReply *partial = resp(
		"*2\r\n"
		"*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:99\r\n$5\r\nnodes\r\n*1\r\n"
		SHARD_NODE("id-r", "7009", "$1\r\nh\r\n", "$1\r\nh\r\n",
				   "$7\r\nreplica\r\n", "$6\r\nonline\r\n")
		"*4\r\n$5\r\nslots\r\n*0\r\n$5\r\nnodes\r\n*1\r\n"
		SHARD_NODE("id-s", "7010", "$1\r\nh\r\n", "$1\r\nh\r\n",
				   "$6\r\nmaster\r\n", "$6\r\nonline\r\n"));
	redisReply *err = resp("-ERR unknown subcommand 'shards'. Try CLUSTER HELP.\r\n");
	redisReply *odd = resp("*1\r\n*4\r\n$5\r\nslots\r\n*1\r\n:0\r\n$5\r\nnodes\r\n*0\r\n");
	redisReply *range = resp(
		"*1\r\n*4\r\n$5\r\nslots\r\n*2\r\n:9\r\n:16384\r\n$5\r\nnodes\r\n*1\r\n"
		SHARD_NODE("id-a", "7001", "$1\r\nh\r\n", "$1\r\nh\r\n",
				   "$6\r\nmaster\r\n", "$6\r\nonline\r\n"));
	int			n;

	n = idem_vc_parse_shards(r, "10.0.0.9", map);
	tap_ok(n == 16384 && map->nnodes == 3,
		   "CLUSTER SHARDS: every slot, three masters (%d, %d)", n, map->nnodes);
	tap_ok(map->slot_node[0] == 0 && map->slot_node[5000] == 0 &&
		   map->slot_node[5001] == 0 && map->slot_node[5460] == 0 &&
		   map->ports[0] == 7001,
		   "a shard's several ranges go to its master, not to its replica");
	tap_ok(map->slot_node[5461] == 1 && strcmp(map->hosts[1], "::1") == 0 &&
		   map->ports[1] == 7002,
		   "a \"?\" endpoint: the node's ip (an IPv6 address here)");
	tap_ok(map->slot_node[16383] == 2 && map->ports[2] == 7006,
		   "a shard listing a failed master and an online one: the online one");
	n = idem_vc_parse_shards(partial, "x", map);
	tap_ok(n == 0 && map->nnodes == 0 && map->slot_node[0] == -1,
		   "a shard without a master, or without slots, covers nothing (%d)", n);
	tap_ok(idem_vc_parse_shards(err, "x", map) == -1 &&
		   idem_vc_parse_shards(odd, "x", map) == -1 &&
		   idem_vc_parse_shards(range, "x", map) == -1 &&
		   idem_vc_parse_shards(NULL, "x", map) == -1,
		   "an error reply, an odd range list or a slot out of range is not a map");
	freeReplyObject(r);
	freeReplyObject(partial);
	freeReplyObject(err);
	freeReplyObject(odd);
	freeReplyObject(range);
	free(map);
}

static int
endpoint(const char *s, char *host, int *port)
{
	*port = -1;
	host[0] = '\0';
	return idem_vc_parse_endpoint(s, strlen(s), 6379, host, 64, port);
}

static void
test_endpoints(void)
{
	char		host[64],
				name[80];
	int			port;

	tap_ok(endpoint("10.0.0.1:7001", host, &port) == 0 &&
		   strcmp(host, "10.0.0.1") == 0 && port == 7001 &&
		   endpoint("cache-a", host, &port) == 0 &&
		   strcmp(host, "cache-a") == 0 && port == 6379,
		   "endpoint: host:port, and a host alone takes the default port");
	tap_ok(endpoint("[::1]:7002", host, &port) == 0 &&
		   strcmp(host, "::1") == 0 && port == 7002 &&
		   endpoint("[fd00::2]", host, &port) == 0 &&
		   strcmp(host, "fd00::2") == 0 && port == 6379,
		   "endpoint: [IPv6 address]:port, and [IPv6 address] alone");
	tap_ok(endpoint("::1", host, &port) == 0 && strcmp(host, "::1") == 0 &&
		   port == 6379 &&
		   endpoint("fe80::1:2", host, &port) == 0 &&
		   strcmp(host, "fe80::1:2") == 0 && port == 6379,
		   "endpoint: a bare IPv6 address is a host without a port");
	tap_ok(endpoint("[::1]7000", host, &port) == -1 &&
		   endpoint("[::1", host, &port) == -1 &&
		   endpoint("[]:7000", host, &port) == -1 &&
		   endpoint("[::1]:", host, &port) == -1 &&
		   endpoint("h:", host, &port) == -1 &&
		   endpoint(":7000", host, &port) == -1 &&
		   endpoint("h:0", host, &port) == -1 &&
		   endpoint("h:65536", host, &port) == -1 &&
		   endpoint("[::1]:99999999999", host, &port) == -1 &&
		   endpoint("h:7x", host, &port) == -1 &&
		   endpoint("", host, &port) == -1,
		   "endpoint: malformed ones are refused");
	idem_vc_format_endpoint(name, sizeof(name), "::1", 7002);
	tap_ok(strcmp(name, "[::1]:7002") == 0, "an IPv6 endpoint is written in brackets");
	idem_vc_format_endpoint(name, sizeof(name), "10.0.0.1", 7001);
	tap_ok(strcmp(name, "10.0.0.1:7001") == 0, "other hosts are not");
}

static void
test_router_without_servers(void)
{
	idem_vc_io	io = {poll_wait, NULL, NULL};
	idem_vc_options opt;
	idem_vc    *vc;
	char		err[200] = "";
	const char *argv[2] = {"GET", "k"};
	idem_vc_cmd cmd;

	memset(&opt, 0, sizeof(opt));
	opt.default_port = 3;
	opt.connect_timeout_ms = 500;
	opt.retry_ms = 1000;
	opt.seeds = "127.0.0.1:1, 127.0.0.1:2,localhost";
	vc = idem_vc_new(&opt, &io, err, sizeof(err));
	tap_ok(vc != NULL && idem_vc_nnodes(vc) == 3 &&
		   strcmp(idem_vc_node_name(vc, 1), "127.0.0.1:2") == 0 &&
		   strcmp(idem_vc_node_name(vc, 2), "localhost:3") == 0,
		   "seed list: host:port and host alone (default port)");
	tap_ok(vc != NULL && idem_vc_open(vc, 2000, err, sizeof(err)) == -1 &&
		   strstr(err, "connect") != NULL && !idem_vc_is_open(vc),
		   "no seed answers: open fails and says why (%s)", err);
	memset(&cmd, 0, sizeof(cmd));
	cmd.key = "k";
	cmd.keylen = 1;
	cmd.argc = 2;
	cmd.argv = argv;
	tap_ok(vc != NULL && idem_vc_pipeline(vc, &cmd, 1, idem_vc_now_ms() + 500) == 0 &&
		   cmd.reply == NULL,
		   "a command with no node stays pending");
	idem_vc_free(vc);
	opt.seeds = "[::1]:1,::1";
	vc = idem_vc_new(&opt, &io, err, sizeof(err));
	tap_ok(vc != NULL && idem_vc_nnodes(vc) == 2 &&
		   strcmp(idem_vc_node_name(vc, 0), "[::1]:1") == 0 &&
		   strcmp(idem_vc_node_name(vc, 1), "[::1]:3") == 0,
		   "seed list: IPv6 seeds, with a port in brackets or alone");
	idem_vc_free(vc);
	opt.seeds = "a:1,b:x";
	tap_ok(idem_vc_new(&opt, &io, err, sizeof(err)) == NULL &&
		   strstr(err, "b:x") != NULL, "a bad seed is refused: %s", err);
	opt.seeds = " , ";
	tap_ok(idem_vc_new(&opt, &io, err, sizeof(err)) == NULL, "no seed is refused");
}

void
test_cluster(void)
{
	test_slots();
	test_classify();
	test_reply_classes();
	test_parse_slots();
	test_parse_shards();
	test_endpoints();
	test_router_without_servers();
}
