# An image-crawler fleet on EC2: one monitor instance and var.worker_count
# worker instances, each running one container under Docker (user_data.sh.tftpl).
# Kafka, Redis and the S3 bucket are not created here: they are inputs.

data "aws_region" "current" {}

data "aws_ssm_parameter" "al2023" {
  name = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
}

locals {
  ami_id        = coalesce(var.ami_id, data.aws_ssm_parameter.al2023.value)
  registry_host = split("/", var.image_registry)[0]
  is_ecr        = can(regex("\\.dkr\\.ecr\\.", local.registry_host))
  # ACCOUNT.dkr.ecr.REGION.amazonaws.com[/prefix]: the two repositories, for a policy scoped to them
  ecr_repository_arns = local.is_ecr ? [for role in ["monitor", "worker"] : format(
    "arn:aws:ecr:%s:%s:repository/%simage-crawler-%s", split(".", local.registry_host)[3],
    split(".", local.registry_host)[0], trimprefix("${trimprefix(var.image_registry, local.registry_host)}/", "/"), role
  )] : []
  log_group     = "/${var.name}"

  # Settings (SPEC.md §5) as environment variables. AWS credentials are
  # deliberately absent: the SDK finds the instance profile by itself.
  plain_environment = merge(
    {
      REDIS_URL          = var.redis_url
      KAFKA_HOSTS        = var.kafka_hosts
      S3_BUCKET          = var.s3_bucket
      AWS_DEFAULT_REGION = data.aws_region.current.name
      URL_PARTITIONS     = tostring(var.url_partitions)
      MAX_TASKS          = tostring(var.max_tasks)
      MONITOR_PORT       = tostring(var.monitor_port)
    },
    # Unset optional inputs keep the crawler's own defaults.
    { for k, v in { SOURCES_URL = var.sources_url, CRAWL_USER_AGENT = var.crawl_user_agent } : k => v if v != null },
    var.extra_environment,
  )
  environment = { for k, v in local.plain_environment : k => v if !contains(keys(var.ssm_environment), k) }

  containers = {
    monitor = { image = "${var.image_registry}/image-crawler-monitor:${var.image_tag}", ports = "-p ${var.monitor_port}:${var.monitor_port}" }
    worker  = { image = "${var.image_registry}/image-crawler-worker:${var.image_tag}", ports = "" }
  }
  user_data = {
    for role, c in local.containers : role => templatefile("${path.module}/user_data.sh.tftpl", {
      container       = role
      image           = c.image
      ports           = c.ports
      environment     = local.environment
      ssm_environment = var.ssm_environment
      ecr_registry    = local.is_ecr ? local.registry_host : ""
      region          = data.aws_region.current.name
      log_group       = local.log_group
    })
  }
}

# --- Credentials: an instance profile, never keys --------------------------
data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "crawler" {
  name               = "${var.name}-instance"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
  tags               = var.tags
}

data "aws_iam_policy_document" "crawler" {
  statement {
    sid       = "WriteThumbnails"
    actions   = ["s3:PutObject"]
    resources = ["arn:aws:s3:::${var.s3_bucket}/*"]
  }
  dynamic "statement" {
    for_each = local.is_ecr ? [1] : []
    content {
      sid       = "EcrLogin"
      actions   = ["ecr:GetAuthorizationToken"] # an account-wide call: IAM knows no resource for it
      resources = ["*"]
    }
  }
  dynamic "statement" {
    for_each = local.is_ecr ? [1] : []
    content {
      sid       = "PullImages"
      actions   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
      resources = local.ecr_repository_arns
    }
  }
  statement {
    sid       = "ShipLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.crawler.arn}:*"]
  }
  dynamic "statement" {
    for_each = length(var.ssm_environment) > 0 ? [1] : []
    content {
      sid       = "ReadSettings"
      actions   = ["ssm:GetParameter"]
      resources = [for p in values(var.ssm_environment) : "arn:aws:ssm:${data.aws_region.current.name}:*:parameter/${trimprefix(p, "/")}"]
    }
  }
}

resource "aws_iam_role_policy" "crawler" {
  name   = "${var.name}-crawler"
  role   = aws_iam_role.crawler.id
  policy = data.aws_iam_policy_document.crawler.json
}

# Session Manager replaces SSH: no port 22, no key pairs.
resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.crawler.name
  policy_arn = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "crawler" {
  name = "${var.name}-instance"
  role = aws_iam_role.crawler.name
  tags = var.tags
}

resource "aws_cloudwatch_log_group" "crawler" {
  name              = local.log_group
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.logs.arn
  tags              = var.tags
}

# The logs carry URLs and hosts of every crawl: encrypted with a key of our own.
data "aws_caller_identity" "current" {}

data "aws_iam_policy_document" "logs_key" {
  #checkov:skip=CKV_AWS_111:a key policy: its resource "*" is this one key
  #checkov:skip=CKV_AWS_356:a key policy: its resource "*" is this one key
  #checkov:skip=CKV_AWS_109:a key policy: its resource "*" is this one key, administered by the account as AWS's default policy does
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"] # in a key policy, "*" means this key
    principals {
      type        = "AWS"
      identifiers = ["arn:aws:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  statement {
    sid       = "CloudWatchLogsUseIt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:aws:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:${local.log_group}"]
    }
  }
}

resource "aws_kms_key" "logs" {
  description         = "${var.name}: CloudWatch logs"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.logs_key.json
  tags                = var.tags
}

# --- Network: nothing open to the world -----------------------------------
resource "aws_security_group" "monitor" {
  name        = "${var.name}-monitor"
  description = "Image crawler monitor: dashboard and metrics for operators only"
  vpc_id      = var.vpc_id
  tags        = var.tags

  dynamic "ingress" {
    for_each = length(var.operator_cidr_blocks) > 0 ? [1] : []
    content {
      description = "Dashboard, /status and /metrics"
      from_port   = var.monitor_port
      to_port     = var.monitor_port
      protocol    = "tcp"
      cidr_blocks = var.operator_cidr_blocks
    }
  }

  #checkov:skip=CKV_AWS_382:by design: SOURCES_URL, Redis, Kafka and the AWS APIs may be anywhere, on any port
  egress {
    description = "Redis, Kafka, SOURCES_URL, the registry and AWS APIs"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "worker" {
  name        = "${var.name}-worker"
  description = "Image crawler workers: no ingress at all"
  vpc_id      = var.vpc_id
  tags        = var.tags

  #checkov:skip=CKV_AWS_382:by design: a crawler fetches images from any website, on any port a URL names
  egress {
    description = "The images' websites anywhere, Redis, Kafka, S3, the registry"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# --- Instances --------------------------------------------------------------
# One monitor only: its regulator is the single writer of the token buckets.
resource "aws_instance" "monitor" {
  ami                         = local.ami_id
  instance_type               = var.monitor_instance_type
  subnet_id                   = var.subnet_ids[0]
  vpc_security_group_ids      = [aws_security_group.monitor.id]
  iam_instance_profile        = aws_iam_instance_profile.crawler.name
  user_data                   = local.user_data["monitor"]
  user_data_replace_on_change = true
  ebs_optimized               = true
  monitoring                  = true # 1-minute CloudWatch metrics: a stalled instance shows within minutes

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 2 # one hop more for the container
  }
  root_block_device {
    encrypted   = true
    volume_size = 20
  }
  tags = merge(var.tags, { Name = "${var.name}-monitor", Role = "monitor" })
}

resource "aws_instance" "worker" {
  count                       = var.worker_count
  ami                         = local.ami_id
  instance_type               = var.worker_instance_type
  subnet_id                   = var.subnet_ids[count.index % length(var.subnet_ids)]
  vpc_security_group_ids      = [aws_security_group.worker.id]
  iam_instance_profile        = aws_iam_instance_profile.crawler.name
  user_data                   = local.user_data["worker"]
  user_data_replace_on_change = true
  ebs_optimized               = true
  monitoring                  = true

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }
  root_block_device {
    encrypted   = true
    volume_size = 20
  }
  tags = merge(var.tags, { Name = "${var.name}-worker-${count.index}", Role = "worker" })
}
