/*
 * shared_names.h
 *   The names, in libidemclient, of the functions it shares with the
 *   extension (../src/common/: cache_format.c, sha256.c, valkey_*.c):
 *   those sources call them idem_cache_*, idem_vc_*, idem_sha256_*,
 *   idem_hmac_*, and so does the extension; in this library they are
 *   idemc_*, so that only the public API (idem_client.h) bears the idem_
 *   prefix, in the static library as in the shared one.  Every object of
 *   the library and of its tests is compiled with -include shared_names.h
 *   (Makefile), and internal.h includes it for a program built on the
 *   library's internals (bench/client_bench.c).  tests/exports.sh fails
 *   when a new shared function is missing here.
 */
#ifndef IDEM_CLIENT_SHARED_NAMES_H
#define IDEM_CLIENT_SHARED_NAMES_H

#define idem_cache_encode_lease_marker idemc_cache_encode_lease_marker
#define idem_cache_encode_terminal idemc_cache_encode_terminal
#define idem_cache_epoch_key idemc_cache_epoch_key
#define idem_cache_hex idemc_cache_hex
#define idem_cache_key idemc_cache_key
#define idem_cache_keyspace idemc_cache_keyspace
#define idem_cache_mac_equal idemc_cache_mac_equal
#define idem_cache_mac_input idemc_cache_mac_input
#define idem_cache_parse idemc_cache_parse
#define idem_cache_put_head idemc_cache_put_head
#define idem_cache_result_ok idemc_cache_result_ok
#define idem_cache_set_mac idemc_cache_set_mac
#define idem_cache_unhex idemc_cache_unhex
#define idem_hmac_key idemc_hmac_key
#define idem_hmac_sha256 idemc_hmac_sha256
#define idem_sha256_accel idemc_sha256_accel
#define idem_sha256_final idemc_sha256_final
#define idem_sha256_init idemc_sha256_init
#define idem_sha256_update idemc_sha256_update
#define idem_vc_all_resting idemc_vc_all_resting
#define idem_vc_classify idemc_vc_classify
#define idem_vc_close_all idemc_vc_close_all
#define idem_vc_collect idemc_vc_collect
#define idem_vc_copy_err idemc_vc_copy_err
#define idem_vc_crc16 idemc_vc_crc16
#define idem_vc_format_endpoint idemc_vc_format_endpoint
#define idem_vc_free idemc_vc_free
#define idem_vc_get_stats idemc_vc_get_stats
#define idem_vc_is_cluster idemc_vc_is_cluster
#define idem_vc_is_open idemc_vc_is_open
#define idem_vc_key_slot idemc_vc_key_slot
#define idem_vc_last_error idemc_vc_last_error
#define idem_vc_new idemc_vc_new
#define idem_vc_nnodes idemc_vc_nnodes
#define idem_vc_node_append idemc_vc_node_append
#define idem_vc_node_call idemc_vc_node_call
#define idem_vc_node_drop idemc_vc_node_drop
#define idem_vc_node_ensure idemc_vc_node_ensure
#define idem_vc_node_errors idemc_vc_node_errors
#define idem_vc_node_expect idemc_vc_node_expect
#define idem_vc_node_failed idemc_vc_node_failed
#define idem_vc_node_flush idemc_vc_node_flush
#define idem_vc_node_get idemc_vc_node_get
#define idem_vc_node_in_map idemc_vc_node_in_map
#define idem_vc_node_lost idemc_vc_node_lost
#define idem_vc_node_name idemc_vc_node_name
#define idem_vc_node_read idemc_vc_node_read
#define idem_vc_node_unsent idemc_vc_node_unsent
#define idem_vc_now_ms idemc_vc_now_ms
#define idem_vc_open idemc_vc_open
#define idem_vc_parse_endpoint idemc_vc_parse_endpoint
#define idem_vc_parse_shards idemc_vc_parse_shards
#define idem_vc_parse_slots idemc_vc_parse_slots
#define idem_vc_pipeline idemc_vc_pipeline
#define idem_vc_refresh idemc_vc_refresh
#define idem_vc_send idemc_vc_send
#define idem_vc_set_err idemc_vc_set_err
#define idem_vc_single_append idemc_vc_single_append
#define idem_vc_single_flush idemc_vc_single_flush
#define idem_vc_single_read idemc_vc_single_read
#define idem_vc_tcp_connect idemc_vc_tcp_connect
#define idem_vc_wire_append idemc_vc_wire_append
#define idem_vc_wire_read idemc_vc_wire_read
#define idem_vc_wire_send idemc_vc_wire_send
#define idem_vc_wire_set_blocking idemc_vc_wire_set_blocking
#define idem_vc_wire_setup idemc_vc_wire_setup
#define idem_vk_error_class idemc_vk_error_class
#define idem_vk_error_code_is idemc_vk_error_code_is
#define idem_vk_error_not_now idemc_vk_error_not_now

#endif
